"""The Ray layer: DistillWorker actors, the stage-scheduling Coordinator, the job entry point."""
