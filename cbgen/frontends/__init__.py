"""Front ends: how users reach the engine (generate_batch, the online Engine, the OpenAI server, batch jobs and Ray, their argument groups)."""
