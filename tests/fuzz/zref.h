/* zref.h - the reference decoder for fuzz_gunzip and fuzz_inflate: zlib, driven to the same
   contract as mgpu__gunzip (every gzip member, concatenated; zero padding after the last one
   tolerated, anything else after it an error) and mgpu__zinflate (one raw DEFLATE stream). */
#ifndef MGPU_ZREF_H
#define MGPU_ZREF_H
#include <zlib.h>

/* Inflates from *src (advancing it past what zlib consumed) until the stream ends, appending to
   out[*len..] (grown as needed). window_bits as for inflateInit2. 1 on success, 0 on an error or
   a truncated stream. */
static inline int zref_inflate(const uint8_t** src, const uint8_t* end, int window_bits, uint8_t** out, size_t* len, size_t* cap) {
    z_stream s;
    int rc;
    memset(&s, 0, sizeof s);
    if (inflateInit2(&s, window_bits) != Z_OK) abort();
    s.next_in = (Bytef*)(uintptr_t)*src;
    s.avail_in = (uInt)(end - *src);
    for (;;) {
        if (*cap - *len < 4096) {
            *cap = *cap * 2 + 4096;
            *out = (uint8_t*)realloc(*out, *cap);
            if (!*out) abort();
        }
        s.next_out = *out + *len;
        s.avail_out = (uInt)(*cap - *len);
        rc = inflate(&s, Z_NO_FLUSH);
        *len = (size_t)(s.next_out - *out);
        if (rc == Z_STREAM_END) break;
        if (rc == Z_OK) continue;
        if (rc == Z_BUF_ERROR && s.avail_out == 0) continue;   /* only wants more room */
        inflateEnd(&s);
        return 0;   /* Z_DATA_ERROR, or Z_BUF_ERROR with all input used: truncated */
    }
    *src = s.next_in;
    inflateEnd(&s);
    return 1;
}

/* mgpu__gunzip's contract on src, which starts with the gzip magic. */
static inline int zref_gunzip(const uint8_t* src, size_t n, uint8_t** out, size_t* len) {
    const uint8_t *p = src, *end = src + n;
    size_t cap = 0;
    *out = NULL;
    *len = 0;
    for (;;) {
        if (!zref_inflate(&p, end, 15 + 16, out, len, &cap)) return 0;
        if (p == end) return 1;
        if (end - p >= 2 && p[0] == 0x1F && p[1] == 0x8B) continue;   /* another member */
        while (p < end && *p == 0) ++p;
        return p == end;
    }
}
#endif
