/* st_rules.h - the safetensors reference implementation's validity rules as data, shared by
   tests/test_io.c (each file refused, or opened) and tests/fuzz/gen_corpus.c (each file a seed).
   A header of json plus buf bytes of data (json NULL: the framing cases, which test_io builds). */
#ifndef ST_RULES_H
#define ST_RULES_H
/* Every validity rule of the reference implementation (huggingface/safetensors 0.8,
   src/tensor.rs: read_metadata, Metadata::validate, its Dtype enum and its tests; the README's
   format section), each with a file that breaks it: refused with MGPU_ERROR_BAD_FILE and a
   message naming the rule. Checked against the Python package: each of these it refuses too. */
typedef struct st_rule { const char* rule; const char* source; const char* json; size_t buf; const char* why; } st_rule;
static const st_rule st_rules[] = {
    {"header too small", "test_header_too_small; README: 8 bytes: N, a u64", NULL, 0, "header too small"},
    {"header too large", "test_header_too_large; MAX_HEADER_SIZE = 100_000_000", NULL, 1, "header too large"},
    {"invalid header length", "test_invalid_header_length: 8 + N past the end", NULL, 2, "invalid header length"},
    {"header is UTF-8", "test_invalid_header_non_utf8", "{\"t\xff\":1}", 0, "invalid UTF-8"},
    {"header is JSON", "test_invalid_header_not_json", "{", 0, "not valid JSON"},
    {"unknown dtype", "Dtype enum (serde): any other name fails to deserialize", "{\"t\":{\"dtype\":\"F8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "unknown dtype"},
    {"offsets contiguous from 0", "test_json_attack (InvalidOffset): sorted by offsets, each starts where the last ended",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}", 3, "invalid offset"},
    {"no holes", "InvalidOffset; README: the byte buffer is entirely indexed, no holes",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},\"u\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[3,5]}}", 5, "hole"},
    {"no overlaps", "InvalidOffset (tests/data attack files: overlapping tensors)",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},\"u\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}", 3, "overlap"},
    {"end not before begin", "InvalidOffset: e < s", "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,0]}}", 2, "invalid offset"},
    {"shape overflow", "test_validation_overflow: checked_mul over the shape, left to right",
     "{\"t\":{\"dtype\":\"I32\",\"shape\":[2,18446744073709551614],\"data_offsets\":[0,16]}}", 16, "validation overflow"},
    {"shape overflow before a 0", "ValidationOverflow: [2^32, 2^32, 0] overflows before its 0",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]}}", 0, "validation overflow"},
    {"bit count overflow", "ValidationOverflow: nelements * bitsize",
     "{\"t\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],\"data_offsets\":[0,8]}}", 8, "validation overflow"},
    {"whole bytes", "MisalignedSlice: sub-byte dtypes (F4, F6) end on a byte boundary",
     "{\"t\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 2, "misaligned slice"},
    {"size matches offsets", "test_invalid_info (TensorInvalidInfo)", "{\"t\":{\"dtype\":\"I32\",\"shape\":[2,2],\"data_offsets\":[0,4]}}", 4,
     "invalid tensor info"},
    {"no trailing bytes", "test_metadata_incomplete_buffer: extra_bogus_data_for_polyglot_file",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 3, "incomplete buffer"},
    {"no missing bytes", "test_metadata_incomplete_buffer: missing 2 bytes",
     "{\"t\":{\"dtype\":\"I32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 14, "incomplete buffer"},
    {"bytes after an empty header", "MetadataIncompleteBuffer with no tensors", "{}", 5, "incomplete buffer"},
    {"one \"__metadata__\"", "serde: duplicate field `__metadata__`", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate"},
    {"metadata values are strings", "HashMap<String, String>", "{\"__metadata__\":{\"k\":1}}", 0, "not a string"},
};

/* Files the reference opens (checked against the Python package), which mgpu must open too. */
typedef struct st_accept { const char* what; const char* json; size_t buf; } st_accept;
static const st_accept st_accepted[] = {
    {"test_empty_shapes_allowed", "{\"test\":{\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[0,4]}}", 4},
    {"test_zero_sized_tensor", "{\"test\":{\"dtype\":\"I32\",\"shape\":[2,0],\"data_offsets\":[0, 0]}}", 0},
    {"test_whitespace_padded_header", "{}\r \t\n", 0},
    {"leading whitespace (0.8 still reads it)", "\t\n{}", 0},
    {"\"__metadata__\": null", "{\"__metadata__\":null}", 0},
    {"a 0 before an overflowing product", "{\"t\":{\"dtype\":\"U8\",\"shape\":[0,4294967296,4294967296],\"data_offsets\":[0,0]}}", 0},
    {"a dimension of 2^63 next to a 0", "{\"t\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808,0],\"data_offsets\":[0,0]}}", 0},
    {"rank 9", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1},
    {"a repeated tensor name: the last entry wins",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]},\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2},
    {"a repeated metadata key: the last value wins", "{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0},
    {"unknown keys in an entry", "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],\"x\":{\"y\":[1]}}}", 2},
    {"F4 in whole bytes", "{\"t\":{\"dtype\":\"F4\",\"shape\":[4],\"data_offsets\":[0,2]}}", 2},
    {"F6_E2M3, 4 of them in 3 bytes", "{\"t\":{\"dtype\":\"F6_E2M3\",\"shape\":[4],\"data_offsets\":[0,3]}}", 3},
    {"the FNUZ float8s", "{\"a\":{\"dtype\":\"F8_E4M3FNUZ\",\"shape\":[2],\"data_offsets\":[0,2]},"
                         "\"b\":{\"dtype\":\"F8_E5M2FNUZ\",\"shape\":[2],\"data_offsets\":[2,4]}}", 4},
};
#endif
