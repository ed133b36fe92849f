"""The backend over vLLM replicas (`--engine-url`): the client (`backend`), its HTTP transport
(`net`), the stream relay (`stream`) and session routing across replicas (`routing`)."""
