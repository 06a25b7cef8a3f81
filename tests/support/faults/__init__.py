"""The fault suite's processes (``benchmarks/fault_suite.py``, ``benchmarks/soak.py`` and
``tests/faults/test_faults.py``), by area:

* :mod:`.model`: the tensor model both sides share (a step's bytes are a pure function of (name,
  step)), process probes and slopes;
* :mod:`.actor`: the actor process's main loop (``python -m tests.support.faults.actor``), which
  runs the ops of :mod:`.stores` (put, pull, serve, checkpoint, recover, zombie writes),
  :mod:`.hostile` (bad records, bad API input) and :mod:`.fuzz` (decoders);
* :mod:`.driver`: the driver side (:class:`~.driver.Actor`, :class:`~.driver.Pool`,
  :class:`~.driver.EtcdProcess`).
"""
