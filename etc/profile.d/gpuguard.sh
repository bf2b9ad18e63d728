# gpuguard: CUDA_VISIBLE_DEVICES set to the GPUs you hold, in every login shell (a terminal or
# not: `ssh host`, tmux panes, `bash -lc` from cron, `su -`). Read from the file the daemon keeps
# for you (and the PAM module reads while the daemon is down), so no daemon is asked; it says
# nothing and changes nothing when you hold no GPU (an exempt user sees every GPU as before).
# GPUGUARD_HELD_DIR: that directory, for a daemon whose socket is not /run/gpuguard/gpuguard.sock.
# See docs/users.md, Any shell. POSIX sh: dash, bash, ksh, and zsh through gpuguard.zsh.
_gpuguard_held="${GPUGUARD_HELD_DIR:-/run/gpuguard/held}/${UID:-$(id -u)}"
if [ -r "$_gpuguard_held" ] && IFS= read -r _gpuguard_devices < "$_gpuguard_held" && [ -n "$_gpuguard_devices" ]; then
    CUDA_VISIBLE_DEVICES=$_gpuguard_devices
    export CUDA_VISIBLE_DEVICES
fi
unset _gpuguard_held _gpuguard_devices
