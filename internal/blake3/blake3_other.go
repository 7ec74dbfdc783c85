//go:build !amd64 || purego

package blake3

import "unsafe"

const wide = false

func compressLanes(in []byte, stride, blocks int, cv *[8]uint32, ctr uint64, perLane bool, flags *[16]uint32, out [][8]uint32) {
	lanesScalar(in, stride, blocks, cv, ctr, perLane, flags, out)
}

func cvBytes(cvs [][8]uint32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(&cvs[0])), 32*len(cvs))
}
