package proto

import "strings"

// SessionDescription is a WebRTC offer or answer, spelled as the W3C RTCSessionDescriptionInit
// (and pion's webrtc.SessionDescription) so that it passes through either unchanged.
type SessionDescription struct {
	Type string `json:"type"` // "offer" or "answer"
	SDP  string `json:"sdp"`
}

// ICECandidate is a trickled ICE candidate, spelled as the W3C RTCIceCandidateInit (and pion's
// webrtc.ICECandidateInit). An empty Candidate signals the end of candidates.
type ICECandidate struct {
	Candidate        string  `json:"candidate"`
	SDPMid           *string `json:"sdpMid,omitempty"`
	SDPMLineIndex    *uint16 `json:"sdpMLineIndex,omitempty"`
	UsernameFragment *string `json:"usernameFragment,omitempty"`
}

// Signal carries WebRTC signaling between two workers through the coordinator, which relays it
// from From to To. The coordinator overwrites From with the id of the connection it came in on,
// so that a worker cannot speak for another.
type Signal struct {
	From string `json:"from"`
	To   string `json:"to"`
	// PlanVersion is the plan under which the two workers are neighbours: signaling for a
	// connection an older plan wanted is ignored.
	PlanVersion uint32 `json:"plan_version"`
	// Exactly one of SDP and Candidate is set.
	SDP       *SessionDescription `json:"sdp,omitempty"`
	Candidate *ICECandidate       `json:"candidate,omitempty"`
	// QUIC, only beside an SDP, is the SHA-256 of the sender's QUIC certificate, in lowercase
	// hex: a native worker offers to move frames over QUIC on the path ICE selects, and accepts
	// only that certificate there, as DTLS accepts only the SDP's fingerprint. A browser sends
	// none, and its links stay on the data channel.
	QUIC string `json:"quic,omitempty"`
}

func (*Signal) Type() MessageType { return TypeSignal }

// maxSDP bounds an SDP: a data-channel-only session description is a few KiB.
const maxSDP = 64 << 10

func (m *Signal) Validate() error {
	if err := checkID("from", m.From); err != nil {
		return err
	}
	if err := checkID("to", m.To); err != nil {
		return err
	}
	if m.From == m.To {
		return invalid("to", "a worker does not signal itself (%s)", quote(m.To))
	}
	if m.QUIC != "" {
		if m.SDP == nil {
			return invalid("quic", "only with an sdp")
		}
		if len(m.QUIC) != 64 || strings.Trim(m.QUIC, "0123456789abcdef") != "" {
			return invalid("quic", "want 64 lowercase hex digits")
		}
	}
	switch {
	case (m.SDP == nil) == (m.Candidate == nil):
		return invalid("signal", "exactly one of sdp and candidate must be set")
	case m.SDP != nil:
		if m.SDP.Type != "offer" && m.SDP.Type != "answer" {
			return invalid("sdp.type", "%s, want \"offer\" or \"answer\"", quote(m.SDP.Type))
		}
		if m.SDP.SDP == "" {
			return invalid("sdp.sdp", "empty")
		}
		return checkText("sdp.sdp", m.SDP.SDP, maxSDP)
	default:
		c := m.Candidate
		if err := checkText("candidate.candidate", c.Candidate, 4096); err != nil {
			return err
		}
		if c.SDPMid != nil {
			if err := checkText("candidate.sdpMid", *c.SDPMid, 256); err != nil {
				return err
			}
		}
		if c.UsernameFragment != nil {
			return checkText("candidate.usernameFragment", *c.UsernameFragment, 256)
		}
	}
	return nil
}
