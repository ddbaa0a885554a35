"""app: the application layer — the `weightsync` command line and the demo.

Installed as `weightsync.app`. The only code that composes the library (`weightsync/`), the
agents (`weightsync.agents`) and the trainer (`weightsync.trainer`); none of those imports it.

Not here: the format, stores and transport (`weightsync/`), the sync agent (`agents/`), training
(`trainer/`).
"""
