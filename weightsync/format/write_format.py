"""write_format: what a publisher may write, so that the readers it serves can read it.

The format has three axes that move independently (docs/format.md, "Versions of the format"):
the chunk header's format version (1, the only one), the codec ids (1-5; a reader decodes the
ids it knows), and the manifest's format version (1; 2 with packs; 3 with box chunks). A reader built at some
point supports what existed then; a publisher that must serve older readers says so with a
`WriteFormat` on its `PublisherConfig`: the highest manifest format and the highest codec id it
may use, and where the model's files go (in each version, or where older `pull`s look for them).
The default writes everything this build can. There is no setting for the chunk header: it has
one version.

`WriteFormat` is the one place compatibility is chosen. How the codec choice is tuned within
what it allows is `weightsync.format.codecs.choice.CodecChoice` (not a compatibility matter), and
how big packs are is `PublisherConfig.pack_bytes`.

Not here: the manifest itself (`manifest.py`), the codecs and their choice (`codecs/`), the
publisher that follows it (`weightsync.publisher`).
"""

from __future__ import annotations

import dataclasses

from weightsync.format.codecs import CODEC_RANS, check_highest_codec
from weightsync.format.manifest import FORMAT_BOXES, FORMAT_PACKS, SUPPORTED_FORMATS


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteFormat:
    """The most a publisher may use of each format axis, for the oldest reader it must serve.

    `WriteFormat(manifest_format=1, highest_codec=3)` is what every reader reads (the first
    release: no packs, codecs full/xor/sparse); `WriteFormat(highest_codec=4)` leaves out only
    `rans`. Versions that need nothing newer are written the old way anyway: a manifest without
    packed chunks is format 1, one without box chunks format 1 or 2, whatever this says.
    """

    manifest_format: int = FORMAT_BOXES
    """Highest manifest format version: 1 = no packs (readable by format-1 readers, every chunk
    its own object), 2 = a delta's chunks may be packed (docs/format.md, "Packs"), 3 = a chunk may
    be a box of its tensor (a tensor- or expert-parallel shard; docs/format.md, "Boxes"). A
    publisher handed boxes with a lower format refuses them: the readers it serves cannot place them."""
    highest_codec: int = CODEC_RANS
    """Highest codec id a chunk may use: 3 = `full`, `xor`, `sparse` (readers before codec 4),
    4 adds `ctx`, 5 adds `rans` (docs/format.md, "Codec ids")."""

    model_files: bool = True
    """Where the model's files (config.json, tokenizer) go: True, into each version (content-addressed
    objects its manifest's producer.files names; readers before it ignore the field); False, one
    mutable copy per model under files/<name>, where `pull`s before producer.files find them
    (docs/format.md, "Model files")."""

    def __post_init__(self) -> None:
        if self.manifest_format not in SUPPORTED_FORMATS:
            raise ValueError(
                f"manifest_format must be one of {list(SUPPORTED_FORMATS)} (1: no packs, for format-1 readers; "
                f"2: packs; 3: box chunks), got {self.manifest_format!r}"
            )
        check_highest_codec(self.highest_codec)

    @property
    def packs(self) -> bool:
        """Whether a delta's chunks may be written into packs."""
        return self.manifest_format >= FORMAT_PACKS
