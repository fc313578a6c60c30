"""``llmforge estimate --rehearse``: the most-loaded rank's real program at full scale on fake tensors.

The build (``llmforge.train.build.build_components``), the parallel transforms and two
training steps (forward and backward over the step's microbatches with the real step runner,
clipping, the optimizer step; the second is the steady one) run in this process on torch's
``FakeTensorMode`` (shapes, dtypes and storages without data) over torch's fake process
group (every collective returns at once), with the rank's coordinates in the plan's
``DeviceMesh``. ``tracker.PeakTracker`` records the tensor bytes live at the peak, by the
estimator's items. Torch side: ``llmforge.estimate`` never imports this package.
"""
