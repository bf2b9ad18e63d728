# gpuguard: the twin of /etc/profile.d/gpuguard.sh for zsh, which reads no /etc/profile.d: a zsh
# login shell runs it from a line in /etc/zsh/zprofile (or ~/.zprofile):
#     [[ -r /etc/profile.d/gpuguard.zsh ]] && . /etc/profile.d/gpuguard.zsh
emulate sh -c '. /etc/profile.d/gpuguard.sh'
