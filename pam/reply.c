/* The daemon's reply, parsed (see reply.h). Bounded by construction: every write goes
 * through emit(), which never passes the field's capacity, and nesting is limited. */
#include <ctype.h>
#include <string.h>

#include "reply.h"

#define MAX_DEPTH 32            /* nesting we are willing to skip over in a reply */

static const char *skip_ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

static int hex4(const char *p, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else
            return -1;
    }
    *out = v;
    return 0;
}

/* Append n bytes to out[cap] at *len if they all fit; otherwise mark truncated. */
static void emit(char *out, size_t cap, size_t *len, int *truncated, const char *s, size_t n)
{
    if (!out)
        return;
    if (*truncated || *len + n >= cap) {
        *truncated = 1;
        return;
    }
    memcpy(out + *len, s, n);
    *len += n;
    out[*len] = '\0';
}

/*
 * Parse the JSON string starting at p (which points at its opening quote) into
 * out[cap], decoding escapes (\uXXXX, surrogate pairs included, to UTF-8). out may
 * be NULL to skip the string. Returns the position after the closing quote, or NULL
 * if the string is malformed.
 */
static const char *parse_string(const char *p, char *out, size_t cap, int *truncated)
{
    size_t len = 0;
    int dummy = 0;

    if (!truncated)
        truncated = &dummy;
    if (out && cap)
        out[0] = '\0';
    if (*p++ != '"')
        return NULL;
    for (;;) {
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            return p + 1;
        if (c == '\0' || c < 0x20)
            return NULL;
        if (c != '\\') {
            emit(out, cap, &len, truncated, p, 1);
            p++;
            continue;
        }
        p++;
        switch (*p) {
        case '"':  emit(out, cap, &len, truncated, "\"", 1); p++; break;
        case '\\': emit(out, cap, &len, truncated, "\\", 1); p++; break;
        case '/':  emit(out, cap, &len, truncated, "/", 1); p++; break;
        case 'b':  emit(out, cap, &len, truncated, "\b", 1); p++; break;
        case 'f':  emit(out, cap, &len, truncated, "\f", 1); p++; break;
        case 'n':  emit(out, cap, &len, truncated, "\n", 1); p++; break;
        case 'r':  emit(out, cap, &len, truncated, "\r", 1); p++; break;
        case 't':  emit(out, cap, &len, truncated, "\t", 1); p++; break;
        case 'u': {
            unsigned cp, low;
            char utf8[4];
            size_t n;
            if (hex4(p + 1, &cp) < 0)
                return NULL;
            p += 5;
            if (cp >= 0xD800 && cp <= 0xDBFF && p[0] == '\\' && p[1] == 'u'
                && hex4(p + 2, &low) == 0 && low >= 0xDC00 && low <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                p += 6;
            } else if (cp >= 0xD800 && cp <= 0xDFFF) {
                cp = '?';               /* a lone surrogate is not a character */
            }
            if (cp < 0x80) {
                utf8[0] = (char)cp;
                n = 1;
            } else if (cp < 0x800) {
                utf8[0] = (char)(0xC0 | (cp >> 6));
                utf8[1] = (char)(0x80 | (cp & 0x3F));
                n = 2;
            } else if (cp < 0x10000) {
                utf8[0] = (char)(0xE0 | (cp >> 12));
                utf8[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
                utf8[2] = (char)(0x80 | (cp & 0x3F));
                n = 3;
            } else {
                utf8[0] = (char)(0xF0 | (cp >> 18));
                utf8[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
                utf8[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
                utf8[3] = (char)(0x80 | (cp & 0x3F));
                n = 4;
            }
            emit(out, cap, &len, truncated, utf8, n);
            break;
        }
        default:
            return NULL;
        }
    }
}

/* Skip one JSON value of any kind; returns the position after it or NULL. */
static const char *skip_value(const char *p, int depth)
{
    p = skip_ws(p);
    if (*p == '"')
        return parse_string(p, NULL, 0, NULL);
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        if (depth >= MAX_DEPTH)
            return NULL;
        p = skip_ws(p + 1);
        if (*p == close)
            return p + 1;
        for (;;) {
            if (close == '}') {
                p = parse_string(skip_ws(p), NULL, 0, NULL);
                if (!p)
                    return NULL;
                p = skip_ws(p);
                if (*p++ != ':')
                    return NULL;
            }
            p = skip_value(p, depth + 1);
            if (!p)
                return NULL;
            p = skip_ws(p);
            if (*p == close)
                return p + 1;
            if (*p++ != ',')
                return NULL;
        }
    }
    /* number, true, false, null */
    if (!strchr("-0123456789tfn", *p) || *p == '\0')
        return NULL;
    while (*p && strchr("+-.0123456789eEtruefalsn", *p))
        p++;
    return p;
}

/* Read the fields we use from the reply's top-level object; others are skipped. */
int gg_parse_reply(const char *json, struct reply *r)
{
    const char *p = skip_ws(json);

    memset(r, 0, sizeof *r);
    if (*p++ != '{')
        return -1;
    p = skip_ws(p);
    if (*p == '}')
        return 0;
    for (;;) {
        char key[32];
        int key_truncated = 0;

        p = parse_string(skip_ws(p), key, sizeof key, &key_truncated);
        if (!p)
            return -1;
        p = skip_ws(p);
        if (*p++ != ':')
            return -1;
        p = skip_ws(p);
        if (key_truncated) {
            p = skip_value(p, 0);
        } else if (strcmp(key, "ok") == 0 && strncmp(p, "true", 4) == 0) {
            r->ok = 1;
            p += 4;
        } else if (strcmp(key, "cuda_visible_devices") == 0 && *p == '"') {
            p = parse_string(p, r->cuda, sizeof r->cuda, &r->cuda_truncated);
        } else if (strcmp(key, "message") == 0 && *p == '"') {
            p = parse_string(p, r->message, sizeof r->message, NULL);
        } else if (strcmp(key, "error") == 0 && *p == '"') {
            p = parse_string(p, r->error, sizeof r->error, NULL);
        } else {
            p = skip_value(p, 0);
        }
        if (!p)
            return -1;
        p = skip_ws(p);
        if (*p == '}')
            return 0;
        if (*p++ != ',')
            return -1;
    }
}

int gg_valid_devices(const char *s)
{
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && !strchr("-_,:/.", *s))
            return 0;
    return 1;
}

void gg_sanitize(char *s)
{
    for (unsigned char *p = (unsigned char *)s; *p; p++) {
        if (*p < 0x20 || *p == 0x7f)
            *p = ' ';
        else if (*p == 0xC2 && p[1] >= 0x80 && p[1] <= 0x9F)
            p[0] = p[1] = ' ';
    }
}
