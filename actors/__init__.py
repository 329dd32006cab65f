"""The Ray layer: DistillWorker actors, their WorkerPool, one run's RunSchedule, the Ray door
(`actors.coordinator.run(job, spec, parts)`), the job entry point."""
