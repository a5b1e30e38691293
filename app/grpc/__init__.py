"""The gRPC transport: a grpc.aio server per worker, the one path every call takes, and the doors
on it (TF Serving's services, the Open Inference Protocol's)."""
