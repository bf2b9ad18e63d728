# gpuguard: the twin of /etc/profile.d/gpuguard.sh for fish login shells: CUDA_VISIBLE_DEVICES set
# to the GPUs you hold, from the file the daemon keeps for you; nothing when you hold none.
if status is-login
    set -l held_dir /run/gpuguard/held
    set -q GPUGUARD_HELD_DIR; and set held_dir $GPUGUARD_HELD_DIR
    set -l held $held_dir/(id -u)
    if test -r $held; and read -l devices <$held; and test -n "$devices"
        set -gx CUDA_VISIBLE_DEVICES $devices
    else if set -q SSH_CONNECTION; and not isatty stdin
        # gpuguard prefs set request-without-terminal on: ssh -T and VS Code Remote-SSH ask for GPUs
        set -l prefs_dir $HOME/.config
        set -q XDG_CONFIG_HOME; and test -n "$XDG_CONFIG_HOME"; and set prefs_dir $XDG_CONFIG_HOME
        if test -e $prefs_dir/gpuguard/request-without-terminal; and set -l exports (gpuguard request)
            string replace -r '^export ' 'set -gx ' -- $exports | string replace '=' ' ' | source
        end
    end
end
