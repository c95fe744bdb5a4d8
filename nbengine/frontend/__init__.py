"""The frontend: Engine, request handles, output processing."""
