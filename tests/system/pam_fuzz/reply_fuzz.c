/*
 * The PAM module's reply parser (pam/reply.c, the very code the module links) fed hostile input.
 *
 * Built two ways by tests/system/test_pam_reply_fuzz.py:
 *   - with gcc or clang and -fsanitize=address,undefined, plus the main() below: each file named
 *     on the command line is one reply; one result line per file on stdout:
 *         <rc> <ok> <cuda_truncated> <valid_devices> <hex cuda> <hex message> <hex error>
 *     (hex of the sanitized strings, "-" when empty), so the test checks what was parsed too;
 *   - with clang -fsanitize=fuzzer,address,undefined -DLIBFUZZER: libFuzzer's own main.
 *
 * The reply is copied into a buffer of exactly its length plus the NUL the module's receive
 * loop adds, so AddressSanitizer sees any read past its end; embedded NULs end it early, as
 * they do in the module.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reply.h"

static struct reply parsed;
static int parsed_rc, parsed_valid;

/* Every field must end inside itself: the parser never fills one to the brim unterminated. */
static void check_terminated(const char *field, size_t cap)
{
    if (strnlen(field, cap) >= cap)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *reply = malloc(size + 1);
    if (!reply)
        return 0;
    memcpy(reply, data, size);
    reply[size] = '\0';
    parsed_rc = gg_parse_reply(reply, &parsed);
    check_terminated(parsed.cuda, sizeof parsed.cuda);
    check_terminated(parsed.message, sizeof parsed.message);
    check_terminated(parsed.error, sizeof parsed.error);
    parsed_valid = gg_valid_devices(parsed.cuda);
    gg_sanitize(parsed.message);
    gg_sanitize(parsed.error);
    free(reply);
    return 0;
}

#ifndef LIBFUZZER
static void put_hex(const char *s)
{
    if (!*s)
        fputs(" -", stdout);
    else
        putchar(' ');
    for (; *s; s++)
        printf("%02x", (unsigned char)*s);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) {
            perror(argv[i]);
            return 2;
        }
        static uint8_t data[1 << 20];
        size_t size = fread(data, 1, sizeof data, f);
        fclose(f);
        LLVMFuzzerTestOneInput(data, size);
        printf("%d %d %d %d", parsed_rc, parsed.ok, parsed.cuda_truncated, parsed_valid);
        put_hex(parsed.cuda);
        put_hex(parsed.message);
        put_hex(parsed.error);
        putchar('\n');
    }
    return 0;
}
#endif
