"""Model processes apart from the HTTP and gRPC workers (MODEL_PROCESSES=N; docs/scaling.md).

Gunicorn's master starts a supervisor (`supervisor`), which starts N model processes
(`server`): each loads the models once and runs their batchers. Workers import no
TensorFlow: their registry (`client`) resolves and checks requests as in the default mode,
and its batchers hand the rows to a model process over a Unix socket (`link`, `wire`), the
arrays in shared memory (`arena`); the model process describes its models to them (`meta`).

Importing this package imports nothing: the master imports `supervisor` alone.
"""
