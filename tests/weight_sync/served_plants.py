"""A vLLM worker extension with planted sync faults, for tests/weight_sync/test_exact_verify.py (the engine's
worker imports it by name: ``served_plants.PlantedExtension``).

``_plant(mode)`` arms one fault for every later load: ``skip:NAME`` leaves checkpoint tensor NAME out of each
reload (its layer keeps the old values); ``no_retie`` skips the re-tie after a reload (a tied output head
whose kernel captured the embedding at load time keeps the old one); ``""`` disarms.
"""

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
