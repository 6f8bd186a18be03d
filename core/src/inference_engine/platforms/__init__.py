"""Platform machinery shared by every platform: which platform runs (:mod:`.selection`),
where device facts come from (:mod:`.device_properties`, :mod:`.device_info`, the
simulated machines of :mod:`.simulated_devices`) and ``--device-ids`` (:mod:`.device_ids`).

The platforms themselves are plugins: the core's CPU and CUDA ones in
``inference_engine.builtin.platforms``, ROCm and XPU in their own distributions, all
implementing :class:`inference_engine.interfaces.platform.Platform`.
"""
