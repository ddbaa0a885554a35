"""sitecustomize for a vLLM server that must not use AMX (`weightsync.app.demo.vllm.no_amx_env`):
torch's AMX probe, which vLLM's CPU attention and SGL GEMM dispatch read, answers False. Imported
by every process of a server started with this directory on its PYTHONPATH; nothing else imports it.
"""

import torch.cpu

torch.cpu._is_amx_tile_supported = lambda: False
