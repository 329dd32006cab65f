"""The Ray layer: DistillWorker actors, their WorkerPool, one run's RunSchedule, the Ray door
(`actors.coordinator.distill_on_ray`), the job entry point."""
