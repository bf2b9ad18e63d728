/*
 * The daemon's reply to pam_gpuguard: one JSON object, of which the module reads
 * "ok", "cuda_visible_devices", "message" and "error" and skips everything else.
 *
 * Apart from the module so that the fuzz and AddressSanitizer harnesses (tests/system/pam_fuzz/)
 * build the very same code: the reply comes from a socket, so it is untrusted input.
 */
#ifndef GPUGUARD_REPLY_H
#define GPUGUARD_REPLY_H

#define GG_HIDDEN __attribute__((visibility("hidden")))  /* not exported from the module */

struct reply {
    int ok;                     /* 1 true, 0 false or absent */
    char cuda[4096];
    int cuda_truncated;
    char message[1024];         /* one line for the user; truncated if longer */
    char error[512];
};

/* Parse a NUL-terminated reply into r (zeroed first); 0, or -1 when it is not a JSON
 * object we can read. Strings too long for their field are truncated (cuda_truncated
 * says so for cuda_visible_devices); nesting deeper than 32 is refused. */
GG_HIDDEN int gg_parse_reply(const char *json, struct reply *r);

/* Whether s holds GPU UUIDs (GPU-..., MIG-...), indices and separators only. */
GG_HIDDEN int gg_valid_devices(const char *s);

/* Make s one printable line: control characters (C0, DEL, and C1 in UTF-8) become spaces. */
GG_HIDDEN void gg_sanitize(char *s);

#endif
