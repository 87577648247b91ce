"""The engine-core process: the engine core and its step loop (:mod:`lmkit.engine.core`),
the step phases its features implement (:mod:`lmkit.engine.phases`), the process entry
point (:mod:`lmkit.engine.core_proc`) and the wire messages it exchanges with the
frontend (:mod:`lmkit.engine.messages`). Contract types live in :mod:`lmkit.api`."""
