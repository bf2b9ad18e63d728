"""`gpuguard replay`: traces, and the daemon's services on a virtual clock."""
