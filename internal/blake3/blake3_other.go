//go:build !amd64 || purego

package blake3

// wide: no AVX-512 lanes here; Sum256 is zeebo/blake3's.
const wide = false

// compressLanes is lanesScalar (sumWide runs only in the tests here).
func compressLanes(in []byte, stride, blocks int, cv *[8]uint32, ctr uint64, perLane bool, flags *[16]uint32, out [][8]uint32) {
	lanesScalar(in, stride, blocks, cv, ctr, perLane, flags, out)
}
