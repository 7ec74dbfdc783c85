// Package blake3 is BLAKE3's 32-byte hash of one contiguous input, fast where the input is large
// and the CPU has AVX-512: 16 chunks (or 16 parent nodes) compressed at once, one per 32-bit lane,
// and the tree merged level by level, 16 parents at a time. The output is BLAKE3's own
// (github.com/zeebo/blake3, which Sum256 calls for small inputs and on other CPUs, computes the
// same bytes; the tests compare the two on every path).
//
// Why a package of its own: an audited worker hashes its whole state (parameters and both
// moments, 12 bytes a parameter) after every update (audit.StateDigest), the largest single part
// of what auditing costs it, and digests every tensor it sends or receives (audit.TensorDigest);
// zeebo/blake3's widest path is AVX2's 8 lanes with rotations built of shifts. With 16 lanes and AVX-512's rotate this hashes large inputs about twice as fast on
// the development machine (BenchmarkSum256).
package blake3
