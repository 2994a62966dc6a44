"""A vLLM worker extension with planted sync faults, for tests/weight_sync/test_exact_verify.py (the engine's
worker imports it by name: ``served_plants.PlantedExtension``).

``_plant(mode)`` arms one fault for every later load: ``skip:NAME`` leaves checkpoint tensor NAME out of each
reload (its layer keeps the old values); ``no_retie`` skips the re-tie after a reload (a tied output head
whose kernel captured the embedding at load time keeps the old one); ``""`` disarms. ``_head_packs_its_weight``
says whether that fault can exist on this machine.
"""

import torch

from ragen_async.inference.vllm_worker_ext import WeightSyncWorkerExtension


class PlantedExtension(WeightSyncWorkerExtension):
    _plant_mode = ""

    def _plant(self, mode: str) -> None:
        type(self)._plant_mode = str(mode)

    def _ragen_reload(self, named, version):
        mode = type(self)._plant_mode
        if mode.startswith("skip:"):
            named = [(n, t) for n, t in named if n != mode.removeprefix("skip:")]
        return super()._ragen_reload(named, version)

    def _ragen_retie(self, version=None):
        if type(self)._plant_mode == "no_retie":
            return 0
        return super()._ragen_retie(version)

    def _head_packs_its_weight(self) -> bool:
        """Whether the output head's kernel computes with its own copy of the weight, made at load time (vLLM's
        CPU GEMM handles pack it on some CPUs and read the Parameter on others): a value changed in place in the
        Parameter does not reach what the kernel computes. Only with such a copy can a skipped re-tie leave the
        head at old values."""
        head = self.model_runner.get_model().lm_head
        w = head.weight
        x = torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device)
        x[0, 0] = 1
        with torch.no_grad():
            before = head.quant_method.apply(head, x, bias=None).clone()
            old = w.data[0, 0].clone()
            w.data[0, 0] += 1
            after = head.quant_method.apply(head, x, bias=None)
            w.data[0, 0] = old
        return bool(torch.equal(before, after))
