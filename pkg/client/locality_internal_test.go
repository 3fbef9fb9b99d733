package client

import (
	"reflect"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/pkg/wire"
)

// localityOf reads the open reply's NUMA fields; an agent from before they
// existed sends none, and every node is then unknown.
func TestLocalityOf(t *testing.T) {
	cases := []struct {
		name string
		rep  *wire.OpenReply
		want Locality
	}{
		{"older agent", &wire.OpenReply{Chunks: []*wire.ChunkGrant{{Id: "a"}, {Id: "b"}}},
			Locality{GPUNUMA: -1, Chunks: []ChunkLocality{{"a", -1}, {"b", -1}}, Unknown: 2}},
		{"mixed", &wire.OpenReply{GpuNuma: proto.Int32(1), Ranks: 2, Chunks: []*wire.ChunkGrant{
			{Id: "a", Numa: proto.Int32(1)}, {Id: "b", Numa: proto.Int32(0)}, {Id: "c", Numa: proto.Int32(-1)}, {Id: "d"}}},
			Locality{GPUNUMA: 1, Ranks: 2, Chunks: []ChunkLocality{{"a", 1}, {"b", 0}, {"c", -1}, {"d", -1}}, Local: 1, Remote: 1, Unknown: 2}},
		{"GPU node unknown", &wire.OpenReply{GpuNuma: proto.Int32(-1), Chunks: []*wire.ChunkGrant{{Id: "a", Numa: proto.Int32(0)}}},
			Locality{GPUNUMA: -1, Chunks: []ChunkLocality{{"a", 0}}, Unknown: 1}},
		{"node 0 is a node", &wire.OpenReply{GpuNuma: proto.Int32(0), Chunks: []*wire.ChunkGrant{{Id: "a", Numa: proto.Int32(0)}}},
			Locality{GPUNUMA: 0, Chunks: []ChunkLocality{{"a", 0}}, Local: 1}},
	}
	for _, c := range cases {
		if got := localityOf(c.rep); !reflect.DeepEqual(got, c.want) || got.CrossNUMA() != (c.want.Remote > 0) {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
}
