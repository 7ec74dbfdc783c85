//go:build !(linux || darwin)

package client

// outerOnHeap: a browser tab (js) has no files to map, and Windows workers keep their outer state
// on the heap too (CreateFileMapping would do; nobody has asked for it yet). The coordinator
// offers the planner a tab's memory less what the state takes (sched.HeapOuterOffer), and the
// worker's own check counts it (outerHeapBytes).
const outerOnHeap = true

func mapOuter(*outerArena, string, int64) error { panic("unreachable: the outer state is on the heap") }

func releaseOuter([]byte) {}

func unmapOuter([]byte) {}
