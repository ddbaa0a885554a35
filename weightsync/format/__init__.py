"""format: what weightsync writes, byte for byte (the spec is docs/format.md).

Element types and their wire codes (`dtypes`), the one hash (`hashing`), where things live in a
store (`layout`), the chunk object (`chunk`), the manifest (`manifest`), packs of chunk objects
(`pack`), state dicts as raw bytes (`tensors`), and the codecs with their change model
(`codecs/`).

Not here: the stores these bytes go to (weightsync.stores), moving them (weightsync.transport).
"""
