package blake3

import (
	"encoding/binary"
	"errors"
)

// Groups, GroupCV and RootOf open BLAKE3's tree at one level, so that a part of a long input can
// be shown to belong to its hash without the rest: an input's chunks fall into groups of
// groupChunks (a power of two; the last group may be shorter), each group is a whole subtree of
// BLAKE3's left-balanced tree, and the hash is the tree over the groups' chaining values. Whoever
// holds the hash, the list of chaining values and one group's bytes checks that the list gives the
// hash (RootOf) and that the bytes give their entry (GroupCV): a forged group would need a
// collision of BLAKE3's compression. Thin audit evidence (package audit) is built on it.

// Groups returns BLAKE3's hash of b (as Sum256) and the chaining values of its groups of
// groupChunks chunks, when b has more than one group; cvs is nil otherwise (a single group's node
// is the root, which has no chaining value of its own).
func Groups(b []byte, groupChunks int) (sum [32]byte, cvs [][32]byte) {
	if groupChunks <= 0 || groupChunks&(groupChunks-1) != 0 {
		panic("blake3: a group is a power of two of chunks")
	}
	if len(b) <= groupChunks*chunkLen {
		return Sum256(b), nil
	}
	return treeWide(b, compressLanes, groupChunks)
}

// treeWide is sumWide's tree, and with groupChunks > 0 the chaining values of its groups of
// groupChunks chunks, kept on the way up (b has more than one group then): every chunk's chaining
// value (16 at a time), then the levels up to the groups' — where, groups being aligned powers of
// two, no pair crosses a group and the last, shorter, group's odd nodes are carried up within it —
// then on to the root.
func treeWide(b []byte, lanes16 lanesFunc, groupChunks int) ([32]byte, [][32]byte) {
	n := (len(b) + chunkLen - 1) / chunkLen
	sp := scratch.Get().(*[][8]uint32)
	defer scratch.Put(sp)
	if cap(*sp) < n {
		*sp = make([][8]uint32, n)
	}
	cvs := (*sp)[:n]
	var chunkFlags, parentFlags [16]uint32
	chunkFlags[0] |= chunkStart
	chunkFlags[15] |= chunkEnd
	parentFlags[0] = parent
	whole := len(b) / chunkLen
	i := 0
	for ; i+lanes <= whole; i += lanes {
		lanes16(b[i*chunkLen:(i+lanes)*chunkLen], chunkLen, chunkLen/blockLen, &iv, uint64(i), true, &chunkFlags, cvs[i:i+lanes])
	}
	for ; i < n; i++ {
		cvs[i] = chunkCV(b[i*chunkLen:min(len(b), (i+1)*chunkLen)], uint64(i))
	}
	var groups [][32]byte
	for size := 1; ; size *= 2 {
		if size == groupChunks {
			groups = make([][32]byte, n)
			for j := range n {
				groups[j] = cvWords(cvs[j])
			}
		}
		if n <= 2 {
			break
		}
		pairs := n / 2
		j := 0
		for ; j+lanes <= pairs; j += lanes {
			lanes16(cvBytes(cvs[2*j:2*j+2*lanes]), blockLen, 1, &iv, 0, false, &parentFlags, cvs[j:j+lanes])
		}
		for ; j < pairs; j++ {
			cvs[j] = parentCV(&cvs[2*j], &cvs[2*j+1], 0)
		}
		if n%2 == 1 {
			cvs[pairs] = cvs[n-1]
		}
		n = pairs + n%2
	}
	return cvWords(parentCV(&cvs[0], &cvs[1], root)), groups
}

// GroupCV is the chaining value of the subtree whose bytes are b (at most a group, not the whole
// input, a whole number of chunks unless it is the input's last) and whose first chunk is chunk
// number first of the input.
func GroupCV(b []byte, first uint64) [32]byte {
	n := max(1, (len(b)+chunkLen-1)/chunkLen)
	cvs := make([][8]uint32, n)
	var chunkFlags [16]uint32
	chunkFlags[0] |= chunkStart
	chunkFlags[15] |= chunkEnd
	whole := len(b) / chunkLen
	i := 0
	for ; i+lanes <= whole; i += lanes {
		compressLanes(b[i*chunkLen:(i+lanes)*chunkLen], chunkLen, chunkLen/blockLen, &iv, first+uint64(i), true, &chunkFlags, cvs[i:i+lanes])
	}
	for ; i < n; i++ {
		cvs[i] = chunkCV(b[i*chunkLen:min(len(b), (i+1)*chunkLen)], first+uint64(i))
	}
	return cvWords(merge(cvs, 0))
}

// RootOf is the hash of an input whose groups' chaining values are cvs, in order: at least two.
func RootOf(cvs [][32]byte) ([32]byte, error) {
	if len(cvs) < 2 {
		return [32]byte{}, errors.New("blake3: a root of fewer than two subtrees")
	}
	ws := make([][8]uint32, len(cvs))
	for i, c := range cvs {
		for k := range ws[i] {
			ws[i][k] = binary.LittleEndian.Uint32(c[4*k:])
		}
	}
	return cvWords(merge(ws, root)), nil
}

// merge reduces cvs (at least one) to one node level by level, adjacent pairs merged and an odd
// one carried up — BLAKE3's left-balanced tree, as sumWide builds it — flagging the last parent
// with extra (root, or 0 for an inner subtree). cvs is overwritten.
func merge(cvs [][8]uint32, extra uint32) [8]uint32 {
	n := len(cvs)
	for n > 2 {
		pairs := n / 2
		for j := range pairs {
			cvs[j] = parentCV(&cvs[2*j], &cvs[2*j+1], 0)
		}
		if n%2 == 1 {
			cvs[pairs] = cvs[n-1]
		}
		n = pairs + n%2
	}
	if n == 1 {
		return cvs[0]
	}
	return parentCV(&cvs[0], &cvs[1], extra)
}

func cvWords(w [8]uint32) [32]byte {
	var out [32]byte
	for k, x := range w {
		binary.LittleEndian.PutUint32(out[4*k:], x)
	}
	return out
}
