"""Stand-in for ``sglang.srt.utils.patch_torch`` (device-UUID keyed CUDA IPC: a no-op on CPU, recorded)."""

import sglang


def monkey_patch_torch_reductions():
    sglang.record("patch_torch", "monkey_patch_torch_reductions")
