"""GPU measurements through NVML: the one NVML entry point (:mod:`.nvml`), what is read per GPU (:mod:`.readers`),
Xid events (:mod:`.xid_events`) and the agent source that ties them together (:mod:`.source`)."""
