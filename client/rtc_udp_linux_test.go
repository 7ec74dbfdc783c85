//go:build linux && !js

package client

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"
)

// datagram i of the sequence TestGSOConn sends: its size follows a pattern of runs of equal
// sizes, shorter tails, small packets between them and a large one, as SCTP over DTLS writes
// them; its bytes say which it is.
func gsoTestDatagram(i int) []byte {
	var n int
	switch {
	case i%97 == 96:
		n = 40000 // too large to join a run
	case i%13 == 12:
		n = 61 // a SACK
	case i%13 == 11:
		n = 700 // the short tail of a message
	default:
		n = 1225
	}
	b := make([]byte, n)
	for j := range b {
		b[j] = byte(i*31 + j)
	}
	copy(b, fmt.Sprintf("%06d", i))
	return b
}

func listenLoopbackUDP(t *testing.T) *net.UDPConn {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadBuffer(udpSocketBuffer)
	_ = c.SetWriteBuffer(udpSocketBuffer)
	return c
}

// TestGSOConn sends datagrams through a gsoConn, in runs, to a gsoConn (GRO) and to a plain
// socket, and checks that both receive exactly the datagrams written, in order: what crosses
// the wire is the same as without offload.
func TestGSOConn(t *testing.T) {
	const count = 600
	for _, gro := range []bool{true, false} {
		t.Run(fmt.Sprintf("gro=%v", gro), func(t *testing.T) {
			tx := newGSOConn(listenLoopbackUDP(t))
			defer tx.Close()
			rxc := listenLoopbackUDP(t)
			var rx interface {
				ReadFromAddrPort([]byte) (int, netip.AddrPort, error)
				SetReadDeadline(time.Time) error
				Close() error
			} = plainUDP{rxc}
			if gro {
				rx = newGSOConn(rxc)
			}
			defer rx.Close()
			to := rxc.LocalAddr().(*net.UDPAddr).AddrPort()
			from := tx.LocalAddr().(*net.UDPAddr).AddrPort()
			d0, s0, r0 := gsoStats.datagrams.Load(), gsoStats.sends.Load(), gsoStats.reads.Load()

			done := make(chan error, 1)
			go func() {
				buf := make([]byte, 64<<10)
				for i := range count {
					_ = rx.SetReadDeadline(time.Now().Add(5 * time.Second))
					n, a, err := rx.ReadFromAddrPort(buf)
					if err != nil {
						done <- fmt.Errorf("datagram %d: %w", i, err)
						return
					}
					if a != from {
						done <- fmt.Errorf("datagram %d from %v, want %v", i, a, from)
						return
					}
					if want := gsoTestDatagram(i); !bytes.Equal(buf[:n], want) {
						done <- fmt.Errorf("datagram %d: got %d bytes starting %q, want %d starting %q", i, n, buf[:min(n, 6)], len(want), want[:6])
						return
					}
				}
				done <- nil
			}()
			for i := range count {
				b := gsoTestDatagram(i)
				if n, err := tx.WriteToAddrPort(b, to); err != nil || n != len(b) {
					t.Fatalf("write %d: %d, %v", i, n, err)
				}
				clear(b) // the conn must have copied it
				if i%50 == 49 {
					time.Sleep(time.Millisecond) // leave the receiver's buffer room, and the linger a chance
				}
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			d, s, r := gsoStats.datagrams.Load()-d0, gsoStats.sends.Load()-s0, gsoStats.reads.Load()-r0
			t.Logf("%d datagrams in %d sends, %d GRO reads (GSO refused: %v, GRO: %v)", d, s, r, tx.gsoOff, gro && rx.(*gsoConn).gro)
			if !tx.gsoOff && s >= d {
				t.Errorf("%d datagrams took %d sends: nothing was coalesced", d, s)
			}
		})
	}
}

// TestGSOConnLinger: a run nothing closes (one full-size datagram) still goes out, by itself.
func TestGSOConnLinger(t *testing.T) {
	tx := newGSOConn(listenLoopbackUDP(t))
	defer tx.Close()
	rx := newGSOConn(listenLoopbackUDP(t))
	defer rx.Close()
	b := gsoTestDatagram(0)
	if _, err := tx.WriteToAddrPort(b, rx.LocalAddr().(*net.UDPAddr).AddrPort()); err != nil {
		t.Fatal(err)
	}
	_ = rx.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, 2048)
	n, _, err := rx.ReadFromAddrPort(got)
	if err != nil || !bytes.Equal(got[:n], b) {
		t.Fatalf("read %d bytes, %v; want the datagram written", n, err)
	}
	if err := tx.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.WriteToAddrPort(b, rx.LocalAddr().(*net.UDPAddr).AddrPort()); err == nil {
		t.Error("a write after Close succeeded")
	}
}

// plainUDP is a socket without GRO, read as ICE reads one.
type plainUDP struct{ *net.UDPConn }

func (c plainUDP) ReadFromAddrPort(b []byte) (int, netip.AddrPort, error) {
	return c.ReadFromUDPAddrPort(b)
}
