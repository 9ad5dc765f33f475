"""gRPC .proto definitions and their generated stubs."""
