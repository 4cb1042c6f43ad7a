"""The client side of the runtime: one training round, the node's own state kept between
rounds, its data and rank from the node config, and the testing fault mod. Imported by the
ClientApp (and the benchmarks' plain loop), never by the server side."""
