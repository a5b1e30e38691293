"""What each protocol says, apart from any socket: JSON, TensorProto and v2 tensors, TF Serving's
classify and regress rules and protos, PredictionLog records. Imports app.core and app.ops."""
