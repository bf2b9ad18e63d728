# gpuguard: CUDA_VISIBLE_DEVICES set to the GPUs you hold, in every login shell (a terminal or
# not: `ssh host`, tmux panes, `bash -lc` from cron, `su -`). Read from the file the daemon keeps
# for you (and the PAM module reads while the daemon is down), so no daemon is asked; it says
# nothing and changes nothing when you hold no GPU (an exempt user sees every GPU as before).
# GPUGUARD_HELD_DIR: that directory, for a daemon whose socket is not /run/gpuguard/gpuguard.sock.
# See docs/users.md, Any shell. POSIX sh: dash, bash, ksh, and zsh through gpuguard.zsh.
# With `gpuguard prefs set request-without-terminal on`, a login shell of an SSH session without a
# terminal (ssh -T, VS Code Remote-SSH's server) asks for GPUs when you hold none: then the
# daemon is asked, once. scp, sftp, rsync and `ssh host cmd` run no login shell.
_gpuguard_held="${GPUGUARD_HELD_DIR:-/run/gpuguard/held}/${UID:-$(id -u)}"
if [ -r "$_gpuguard_held" ] && IFS= read -r _gpuguard_devices < "$_gpuguard_held" && [ -n "$_gpuguard_devices" ]; then
    CUDA_VISIBLE_DEVICES=$_gpuguard_devices
    export CUDA_VISIBLE_DEVICES
elif [ -n "${SSH_CONNECTION-}" ] && [ ! -t 0 ] \
        && [ -e "${XDG_CONFIG_HOME:-$HOME/.config}/gpuguard/request-without-terminal" ] \
        && _gpuguard_devices=$(gpuguard request); then
    eval "$_gpuguard_devices"  # request's stdout is the export line; what it says goes to stderr
fi
unset _gpuguard_held _gpuguard_devices
