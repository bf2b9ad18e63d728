"""What each key of gpuguard.toml means, for gpuguard.toml(5) (packaging/manpages.py).

The keys, and the defaults the page prints, come from the loader itself (config.SCHEMA and the
config dataclasses); this table only adds the words. The page's generator refuses a key of
SCHEMA that has no entry here, and an entry for a key SCHEMA does not know, so neither can
drift from the other.

Each entry: (kind, meaning). The kind says how a value is written and how the default prints:
"size" (512MiB, 20GiB, unlimited), "duration" (90s, 30m, 8h, 2d, none), "names" (a list of
strings), "bool", "integer", "count" (a whole number or "any"), "number", "string", "path", "choice", "table".
"""
from __future__ import annotations

SECTIONS: dict[str, str] = {
    "access": "Who gets GPUs, who is never restricted, and how access is enforced.",
    "sessions": "Which PAM sessions take GPUs; the others only see the GPUs their user already holds.",
    "defaults": "Every user's quota, unless quotas.toml says otherwise for the user or one of their groups "
                "(the same keys, in [users.NAME] and [groups.NAME] tables; a user's own entry wins over their "
                "group's, which wins over these, key by key).",
    "watcher": "How often the GPUs are sampled, and how long a process over its quota is given.",
    "events": "How much event history is kept (what gpuguard whoami and gpuguard events show).",
    "scheduler": "The queue for GPUs when none is free.",
    "paths": "Where gpuguard keeps its state, its socket and its nodes.",
    "gpu": "Where the GPUs come from.",
    "metrics": "Prometheus metrics and the files other tools read; read at start only, every one off until set.",
    "notify": "Notices for users without a terminal (VS Code, Jupyter): every line gpuguard writes to a user's "
              "terminals also goes to their webhook and e-mail address; off until webhook or mail is set "
              "(or addresses names some). Taken up again by a reload.",
    "web": "gpuguard web, the read-only web view (its own process and unit, gpuguard-web.service): off until listen is set.",
    "coexist": "GPUs another system (Slurm, Kubernetes) hands out on this machine: left out of the gate, the ACLs "
               "and allocation; read at start only.",
    "fleet": "Several servers sharing one PostgreSQL: a fleet quota (fleet_gpus), fair share over every server, "
               "gpuguard where and gpuguard status --fleet. Off (a single server) unless the table is written; read "
               "at start only. [fleet.data] maps storage paths to the nodes or racks holding them: "
               "\"/data/imagenet\" = [\"gpu1\", \"rack-b\"].",
    "gpu.simulated": "Simulated GPUs (backend = \"simulated\"): the demo and the tests; no GPU needed.",
}

KEYS: dict[tuple[str, str], tuple[str, str]] = {
    ("access", "group"): ("string", "only members of this group get GPUs"),
    ("access", "exempt_users"): ("names", "users never restricted and never stopped (root always is); "
                                          "nvidia-persistenced keeps every GPU open, so keep it here"),
    ("access", "exempt_groups"): ("names", "the same for every member of these groups"),
    ("access", "mode"): ("choice", "gate: the BPF device program plus node ACLs; acl: the ACLs only (weaker, "
                                   "an explicit choice)"),
    ("sessions", "grant"): ("choice", "interactive: sessions with a terminal, or of one of services, take GPUs; "
                                      "all: every session does"),
    ("sessions", "services"): ("names", "PAM services whose sessions take GPUs without a terminal (jupyterhub)"),
    ("defaults", "gpus"): ("integer", "GPUs (or MIG slices) a user may hold"),
    ("defaults", "gpu_memory"): ("size", "GPU memory a user may use on each GPU"),
    ("defaults", "max_time"): ("duration", "how long a grant lasts"),
    ("defaults", "idle_timeout"): ("duration", "release a grant after this long with no process on its GPUs"),
    ("defaults", "sharing"): ("bool", "may share a GPU with other sharing users (needs gpu_memory)"),
    ("defaults", "priority"): ("integer", "the queue serves higher first (any whole number)"),
    ("defaults", "share"): ("number", "fair-share weight: recent usage counts divided by it"),
    ("defaults", "reclaim_after"): ("duration", "release after this long with no process, only while someone waits "
                                                "(\"none\": never)"),
    ("defaults", "slices"): ("count", "how many of gpus may be MIG slices, or \"any\""),
    ("defaults", "whole_gpus"): ("bool", "whether whole GPUs may be granted (false: MIG slices only)"),
    ("defaults", "slice_profiles"): ("names", "which MIG profiles, preferred in this order (empty: any, smallest first)"),
    ("defaults", "fleet_gpus"): ("integer", "GPUs a user may hold on all servers of a fleet together ([fleet]), "
                                              "or \"none\" (unset: no fleet limit)"),
    ("defaults", "max_sharers"): ("integer", "sharing: at most this many users on one GPU (and never more memory "
                                             "quotas promised than it has)"),
    ("defaults", "fraction_memory"): ("size", "a login, a plain request, run and a notebook ask for a fraction of "
                                              "one GPU of this much memory (unset: whole GPUs)"),
    ("defaults", "max_fractions"): ("count", "fractions a user may hold at once, or \"any\" (as many as gpus); 0: none"),
    ("defaults", "min_fraction_memory"): ("size", "the smallest fraction a user may ask for"),
    ("defaults", "max_fraction_memory"): ("size", "the largest fraction a user may ask for (unset: a whole GPU's "
                                                  "memory)"),
    ("watcher", "interval"): ("duration", "how often GPUs are sampled (at least 1s with the nvml backend)"),
    ("watcher", "grace"): ("duration", "over quota this long before the first SIGTERM"),
    ("watcher", "kill_wait"): ("duration", "SIGTERM this long before SIGKILL"),
    ("events", "max_age"): ("duration", "events older than this are deleted"),
    ("events", "per_user"): ("integer", "a user's events beyond their newest per_user are deleted"),
    ("scheduler", "half_life"): ("duration", "recent usage (fair share) halves in this time"),
    ("scheduler", "reserve_after"): ("duration", "a request this long in the queue has free GPUs held for it"),
    ("scheduler", "soft_max_time"): ("bool", "past max_time, a grant is taken only when someone waits"),
    ("scheduler", "max_wait_boost"): ("duration", "a request this long in the queue goes ahead of every younger one "
                                                  "of its priority, whatever its user's recent usage"),
    ("scheduler", "fraction_placement"): ("choice", "how a fraction's GPU is chosen: fgd (keeps whole GPUs free for "
                                                    "the asks seen lately), best-fit or first-fit"),
    ("paths", "state_dir"): ("path", "the store (SQLite) and the daemon's state"),
    ("paths", "socket"): ("path", "the daemon's socket (the PAM module's socket= option must match)"),
    ("paths", "device_dir"): ("path", "where the GPU nodes are"),
    ("paths", "quotas"): ("path", "per-user and per-group quotas; relative to the config file's directory "
                                  "(default: quotas.toml next to it)"),
    ("gpu", "backend"): ("choice", "nvml: the real GPUs, through NVIDIA's NVML; simulated: see [gpu.simulated]"),
    ("gpu", "simulated"): ("table", "the [gpu.simulated] table below"),
    ("metrics", "listen"): ("string", "ADDRESS:PORT of the /metrics endpoint, e.g. 127.0.0.1:9447 (unset: off)"),
    ("metrics", "textfile"): ("path", "node_exporter textfile collector file, ending in .prom (unset: off)"),
    ("metrics", "dcgm_job_mapping_dir"): ("path", "dcgm-exporter's HPC job mapping directory (unset: off)"),
    ("notify", "webhook"): ("string", "URL that gets each notice as a JSON POST ({\"text\", \"user\", \"host\", "
                                      "\"time\"}); {user} becomes the user's name, URL-quoted (unset: off)"),
    ("notify", "mail"): ("string", "e-mail address each notice is mailed to through sendmail; {user} becomes the "
                                   "user's name, e.g. \"{user}@lab.example\" (unset: off)"),
    ("notify", "addresses"): ("path", "TOML file of [users.NAME] tables with webhook and mail, used over the templates "
                                      "above for those users (unset: none)"),
    ("notify", "sendmail"): ("path", "the MTA's sendmail program, run as sendmail -oi -- ADDRESS"),
    ("notify", "per_user_hour"): ("integer", "notices per user and hour sent to the webhook and mail; more are "
                                             "dropped and counted"),
    ("web", "listen"): ("string", "ADDRESS:PORT it serves on, e.g. 127.0.0.1:8447 (unset: off)"),
    ("web", "user"): ("string", "the account gpuguard web runs as (never root); the daemon lets it read every "
                                "user's whoami, report and events, and nothing more"),
    ("web", "show_users"): ("bool", "false: other users' names are hidden from everyone but admins"),
    ("web", "admin_group"): ("string", "members see every user's page and usage (unset: nobody)"),
    ("web", "pam_service"): ("string", "the PAM service of the web login (/etc/pam.d/gpuguard-web)"),
    ("web", "key_file"): ("path", "the key that signs the forms' CSRF tokens; made at the first start, mode 0600"),
    ("web", "session_time"): ("duration", "how long a web login lasts"),
    ("web", "secure_cookies"): ("bool", "cookies only over HTTPS (browsers allow http://localhost too)"),
    ("web", "trusted_proxies"): ("names", "reverse proxies (addresses or networks) whose X-Forwarded-For names the "
                                         "client for the login delay and PAM_RHOST; ignored from anyone else"),
    ("web", "tls_cert"): ("path", "serve HTTPS with this certificate chain (PEM, readable by the web's account); "
                                  "with tls_key, both or neither"),
    ("web", "tls_key"): ("path", "the private key of tls_cert (PEM)"),
    ("web", "contact"): ("string", "whom the page tells a user outside the GPU group to ask (an address, a room); "
                                   "unset: the server's administrators, the members of admin_group if set"),
    ("coexist", "slurm"): ("string", "\"auto\": the GPUs gres.conf gives this node are Slurm's (AutoDetect=nvml: all); "
                                     "\"off\": none are; or a list of Slurm's GPU minors. Unset on a Slurm node "
                                     "(slurmd running, gres.conf present): the daemon refuses to start (exit 6)"),
    ("coexist", "gres_conf"): ("path", "Slurm's gres.conf (must be root's and writable by root alone)"),
    ("coexist", "slurm_node"): ("string", "this host's Slurm NodeName (unset: the short host name)"),
    ("coexist", "k8s_gpus"): ("names", "GPU minors the Kubernetes device plugin hands to containers"),
    ("fleet", "database"): ("string", "the fleet's PostgreSQL, a libpq connection string or URI (required); two "
                                        "hosts and target_session_attrs=read-write follow a promoted standby. Keep "
                                        "passwords in root's ~/.pgpass, not here: gpuguard.toml is readable by users"),
    ("fleet", "node"): ("string", "this server's name in the fleet, unique (unset: the short host name)"),
    ("fleet", "rack"): ("string", "its rack, for gpuguard where's locality"),
    ("fleet", "ssh"): ("string", "what gpuguard where prints after ssh (unset: node)"),
    ("fleet", "heartbeat"): ("duration", "how often this node sends its GPUs, grants and queue to the database"),
    ("fleet", "lease"): ("duration", "silent this long, the node shows as lost (at least twice heartbeat)"),
    ("fleet", "grace"): ("duration", "lost this long more, its grants stop counting against fleet quotas"),
    ("fleet", "timeout"): ("duration", "the longest a login waits on the database; then the node decides alone "
                                         "until a heartbeat succeeds"),
    ("fleet", "offline_policy"): ("choice", "while the database cannot be reached: local (the local quota alone) or "
                                              "budget (also the fleet quota less what the user held elsewhere when "
                                              "last seen)"),
    ("fleet", "data"): ("table", "the [fleet.data] table: absolute storage paths to node or rack names"),
    ("gpu.simulated", "count"): ("integer", "how many GPUs"),
    ("gpu.simulated", "memory"): ("size", "memory of each"),
    ("gpu.simulated", "name"): ("string", "their model name (H100 or H200 in it: MIG with that GPU's profiles)"),
    ("gpu.simulated", "nvlink_groups"): ("table", "lists of GPU minors joined by NVLink (unset: consecutive pairs)"),
    ("gpu.simulated", "pcie_switches"): ("table", "lists of GPU minors behind one PCIe switch (unset: groups of four)"),
    ("gpu.simulated", "numa_nodes"): ("table", "lists of GPU minors per NUMA node (unset: two halves)"),
    ("gpu.simulated", "mig"): ("table", "GPUs in MIG mode and their slices, e.g. { \"0\" = [\"3g.40gb\", \"1g.10gb\"] }"),
}
