"""The HTTP transport: its WSGI layers, its route tables and the doors on them (TF Serving's REST
API, the Open Inference Protocol), body limits, error answers, OpenAPI. The one place (with the
app factory) that imports Flask."""
