package proto

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"unicode/utf8"
)

// ProtocolVersion is the control protocol this build speaks, and the only one it accepts. It is
// bumped for any change that an older peer could misread, which includes adding a field: decoding
// is strict (unknown fields are errors), so that a typo or a half-upgraded peer fails loudly
// instead of running with a field silently zeroed — and any change to what a digest on the wire is
// made of (11: state digests hash values with BLAKE3), which an older peer would compute
// differently and be judged a cheat for — or to what a job's spec means (12: an outer-mode spec
// carries its synchronous warm-up, job.Sync.Warmup, and counts its rounds from it) — or to what a
// message asks (13: a delayed outer step is answered with OuterDone and taken up only after its
// OuterCommit, as an undelayed one is; 14: Assign.Standby, a holder handing its stage over before
// it stands by; 15: the I4 dtype, which a job's "int4" wire format sends; 16: an outer-step signature covers a
// batch of segments, OuterSig; 17: a restore names the checkpoint's shards a stage reads,
// CheckpointRef.Blobs, not one whole-model file; 18: an audit may ask for thin evidence,
// Audit.Sample).
const ProtocolVersion = 18

// MaxMessageSize bounds a control message. The largest ordinary one is a step report with a
// ‖g‖² for every tensor of a shard (about 80 bytes per tensor); tensors themselves travel as frames.
const MaxMessageSize = 1 << 20

// Role is a side of the control connection.
type Role uint8

const (
	RoleWorker Role = 1 + iota
	RoleCoordinator
)

func (r Role) String() string {
	switch r {
	case RoleWorker:
		return "worker"
	case RoleCoordinator:
		return "coordinator"
	}
	return fmt.Sprintf("role(%d)", uint8(r))
}

// peer is the other side of a control connection: workers talk only to the coordinator, which
// relays what they say to each other.
func (r Role) peer() Role {
	if r == RoleWorker {
		return RoleCoordinator
	}
	return RoleWorker
}

// MessageType is the "type" field of a control message.
type MessageType string

const (
	TypeHello       MessageType = "hello"        // worker → coordinator: join
	TypeWelcome     MessageType = "welcome"      // coordinator → worker: accepted, here is your id
	TypeAssign      MessageType = "assign"       // coordinator → worker: hold this shard under this plan
	TypeSignal      MessageType = "signal"       // worker → coordinator → worker: WebRTC signaling
	TypeStepOpen    MessageType = "step_open"    // coordinator → worker: run a step
	TypeStepReport  MessageType = "step_report"  // worker → coordinator: the step's gradient norms and losses
	TypeClip        MessageType = "clip"         // coordinator → worker: clip factor; apply the update
	TypeHeartbeat   MessageType = "heartbeat"    // either way
	TypeError       MessageType = "error"        // either way
	TypeBye         MessageType = "bye"          // either way: leaving on purpose
	TypeReady       MessageType = "ready"        // worker → coordinator: shard loaded, neighbour links open
	TypeCheckpoint  MessageType = "checkpoint"   // coordinator → worker: upload your shard's checkpoint
	TypeAudit       MessageType = "audit"        // coordinator → worker: upload the evidence of a step
	TypeOuterSync   MessageType = "outer_sync"   // coordinator → worker: take the outer step (sync mode "outer")
	TypeLeaving     MessageType = "leaving"      // worker → coordinator: let me go at the next step boundary
	TypeChallenge   MessageType = "challenge"    // coordinator → worker: prove your identity (identity.go)
	TypeProof       MessageType = "proof"        // worker → coordinator: the signed challenge
	TypePeerLeft    MessageType = "peer_left"    // coordinator → worker: a peer of your plan left the job
	TypeOuterDone   MessageType = "outer_done"   // worker → coordinator: the outer step's average is in, not applied
	TypeOuterCommit MessageType = "outer_commit" // coordinator → worker: apply the outer step's average
	TypeStepReroute MessageType = "step_reroute" // coordinator → worker: a replica was lost mid-step; compute these micro-batches too
)

// messageTypes builds an empty message of each type, and says which role sends it.
var messageTypes = map[MessageType]struct {
	from Role // 0: either side
	new  func() Message
}{
	TypeHello:       {RoleWorker, func() Message { return new(Hello) }},
	TypeWelcome:     {RoleCoordinator, func() Message { return new(Welcome) }},
	TypeAssign:      {RoleCoordinator, func() Message { return new(Assign) }},
	TypeSignal:      {0, func() Message { return new(Signal) }},
	TypeStepOpen:    {RoleCoordinator, func() Message { return new(StepOpen) }},
	TypeStepReport:  {RoleWorker, func() Message { return new(StepReport) }},
	TypeClip:        {RoleCoordinator, func() Message { return new(Clip) }},
	TypeHeartbeat:   {0, func() Message { return new(Heartbeat) }},
	TypeError:       {0, func() Message { return new(Error) }},
	TypeBye:         {0, func() Message { return new(Bye) }},
	TypeReady:       {RoleWorker, func() Message { return new(Ready) }},
	TypeCheckpoint:  {RoleCoordinator, func() Message { return new(Checkpoint) }},
	TypeAudit:       {RoleCoordinator, func() Message { return new(Audit) }},
	TypeOuterSync:   {RoleCoordinator, func() Message { return new(OuterSync) }},
	TypeLeaving:     {RoleWorker, func() Message { return new(Leaving) }},
	TypeChallenge:   {RoleCoordinator, func() Message { return new(Challenge) }},
	TypeProof:       {RoleWorker, func() Message { return new(Proof) }},
	TypePeerLeft:    {RoleCoordinator, func() Message { return new(PeerLeft) }},
	TypeOuterDone:   {RoleWorker, func() Message { return new(OuterDone) }},
	TypeOuterCommit: {RoleCoordinator, func() Message { return new(OuterCommit) }},
	TypeStepReroute: {RoleCoordinator, func() Message { return new(StepReroute) }},
}

// Message is a control message: one of *Hello, *Welcome, *Assign, *Signal, *StepOpen,
// *StepReport, *Clip, *Heartbeat, *Error, *Bye.
type Message interface {
	// Type is the message's "type" field.
	Type() MessageType
	// Validate reports the first invalid field. EncodeMessage and DecodeMessage call it.
	Validate() error
}

// envelope is a message on the wire: {"v":1,"type":"hello","body":{...}}. The version and type
// sit outside the body so that they can be read before the body's schema is known; "v" and
// "type" are the only keys every protocol version must keep.
type envelope struct {
	V    int             `json:"v"`
	Type MessageType     `json:"type"`
	Body json.RawMessage `json:"body"`
}

// EncodeMessage validates m and returns its JSON encoding with the protocol version.
func EncodeMessage(m Message) ([]byte, error) {
	if m == nil || reflect.ValueOf(m).IsNil() {
		return nil, fmt.Errorf("encode message: %w: nil message", ErrBadMessage)
	}
	t := m.Type()
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("encode %s: %w", t, err)
	}
	body, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode %s: %w: %v", t, ErrBadMessage, err)
	}
	b, err := json.Marshal(envelope{V: ProtocolVersion, Type: t, Body: body})
	if err != nil {
		return nil, fmt.Errorf("encode %s: %w: %v", t, ErrBadMessage, err)
	}
	if len(b) > MaxMessageSize {
		return nil, fmt.Errorf("encode %s: %w: %d bytes, limit %d", t, ErrMessageTooLarge, len(b), MaxMessageSize)
	}
	return b, nil
}

// DecodeMessage decodes a control message received by the local side. It checks, in order: the
// size, the protocol version (a mismatch is a *VersionError that says which side to upgrade),
// the type, that the peer's side sends that type, the body's fields (unknown fields are errors)
// and their values.
func DecodeMessage(b []byte, local Role) (Message, error) {
	if local != RoleWorker && local != RoleCoordinator {
		return nil, fmt.Errorf("decode message: unknown local role %v", local)
	}
	if len(b) > MaxMessageSize {
		return nil, fmt.Errorf("decode message: %w: %d bytes, limit %d", ErrMessageTooLarge, len(b), MaxMessageSize)
	}
	// The version is read before anything else, leniently: a newer peer's message may have
	// fields this build cannot parse, and the useful error is the version, not the field.
	var head struct {
		V    *int        `json:"v"`
		Type MessageType `json:"type"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return nil, fmt.Errorf("decode message: %w: %v", ErrBadMessage, err)
	}
	if head.V == nil {
		return nil, fmt.Errorf("decode message from %v: %w: no \"v\" field (not a Shoal control message?)", local.peer(), ErrProtocolVersion)
	}
	if *head.V != ProtocolVersion {
		return nil, &VersionError{Peer: local.peer(), PeerVersion: *head.V, LocalVersion: ProtocolVersion}
	}
	var env envelope
	if err := strictUnmarshal(b, &env); err != nil {
		return nil, fmt.Errorf("decode message: %w: %v", ErrBadMessage, err)
	}
	kind, ok := messageTypes[env.Type]
	if !ok {
		return nil, fmt.Errorf("decode message: %w %s", ErrUnknownType, quote(string(env.Type)))
	}
	if kind.from != 0 && kind.from != local.peer() {
		return nil, fmt.Errorf("decode %s: %w: a %v does not send %s", env.Type, ErrUnexpectedMessage, local.peer(), env.Type)
	}
	if len(env.Body) == 0 || env.Body[0] != '{' {
		return nil, fmt.Errorf("decode %s: %w: body must be a JSON object", env.Type, ErrBadMessage)
	}
	m := kind.new()
	if err := strictUnmarshal(env.Body, m); err != nil {
		return nil, fmt.Errorf("decode %s: %w: %v", env.Type, ErrBadMessage, err)
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("decode %s: %w", env.Type, err)
	}
	return m, nil
}

// strictUnmarshal is json.Unmarshal that refuses unknown fields and trailing data.
func strictUnmarshal(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("data after the JSON value")
	}
	return nil
}

// VersionError is returned by DecodeMessage when the peer speaks another protocol version.
// Its text names the fix, e.g. "coordinator speaks protocol 4, this worker speaks 3: upgrade
// the worker".
type VersionError struct {
	Peer         Role // the side that sent the message
	PeerVersion  int
	LocalVersion int
}

func (e *VersionError) Error() string {
	older := e.Peer
	if e.PeerVersion > e.LocalVersion {
		older = e.Peer.peer()
	}
	fix := "upgrade the " + older.String()
	if older == RoleWorker {
		fix += " (a browser worker: reload the page)"
	}
	return fmt.Sprintf("%v speaks protocol %d, this %v speaks %d: %s", e.Peer, e.PeerVersion, e.Peer.peer(), e.LocalVersion, fix)
}

// Unwrap makes errors.Is(err, ErrProtocolVersion) true.
func (e *VersionError) Unwrap() error { return ErrProtocolVersion }

// invalid returns an ErrBadMessage error about one field.
func invalid(field, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrBadMessage, field, fmt.Sprintf(format, args...))
}

// quote quotes a peer-supplied string for an error message, truncated: errors are logged.
func quote(s string) string {
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	return strconv.Quote(s)
}

// maxID bounds worker and job ids; they end up in logs, metrics labels and URLs.
const maxID = 64

// checkID validates a worker or job id: 1 to 64 of [A-Za-z0-9._-].
func checkID(field, s string) error {
	if s == "" || len(s) > maxID {
		return invalid(field, "id %s must be 1 to %d characters", quote(s), maxID)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return invalid(field, "id %s may only use letters, digits, '.', '_' and '-'", quote(s))
		}
	}
	return nil
}

// checkOptionalID is checkID where "" means none.
func checkOptionalID(field, s string) error {
	if s == "" {
		return nil
	}
	return checkID(field, s)
}

// checkText validates free text: valid UTF-8 (so that it survives a JSON round trip unchanged)
// and at most max bytes.
// SessionBytes is the length of a session credential's random part; on the wire it is
// base64url without padding (43 characters).
const SessionBytes = 32

// checkOptionalSession checks the shape of a session credential ("" allowed): 43 characters of
// base64url. Its value is checked by the coordinator, in constant time.
func checkOptionalSession(s string) error {
	if s == "" {
		return nil
	}
	if len(s) != 43 {
		return invalid("session", "%d characters, want 43", len(s))
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return invalid("session", "not base64url")
		}
	}
	return nil
}

// checkLabel is checkText for a peer-chosen label shown to people (a worker's name): printable
// text only, no control characters or line breaks, so that it cannot forge log lines or lay out a
// page; pages still escape it.
func checkLabel(field, s string, max int) error {
	if err := checkText(field, s, max); err != nil {
		return err
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == 0x2028 || r == 0x2029 {
			return invalid(field, "control character %U", r)
		}
	}
	return nil
}

func checkText(field, s string, max int) error {
	if len(s) > max {
		return invalid(field, "%d bytes, at most %d", len(s), max)
	}
	if !utf8.ValidString(s) {
		return invalid(field, "not valid UTF-8")
	}
	return nil
}
