"""The public API: the gRPC server and servicer, interceptors, auth, validation, the SMG engine service, the load report, model paths and the loaded model's state."""
