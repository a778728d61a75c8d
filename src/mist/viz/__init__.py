"""Pictures of simulated schedules."""
