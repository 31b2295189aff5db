"""Everything that touches a GPU host: SSH hosts, the machine-wide lease, provisioning, the vLLM server, log diagnosis."""
