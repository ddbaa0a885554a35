"""transport: versions over gRPC. The pieces both ends share (`rpc`), the push client that
streams versions to agents (`push`), manifest signatures (`signing`) and the generated protobuf
code of the wire contract (`v1`, from proto/weightsync/transport/v1/sync.proto).

Not here: the agent's server (weightsync.agents.server), what is sent (weightsync.format).
"""
