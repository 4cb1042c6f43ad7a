"""The server side of the runtime: the run folder's metrics recorder, checkpoints, the
console and TensorBoard tracking. Imported by the ServerApp, never by the client side."""
