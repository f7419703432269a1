"""Python modules generated from proto/ by `make proto` (grpc_tools.protoc); do not edit.

tests/unit/test_proto_fresh.py fails when they no longer match proto/.
"""
