"""The product, below every protocol: the call and its exchange, errors, models, the batching
engine, the registry of versions and the request layer. Imports only app.ops."""
