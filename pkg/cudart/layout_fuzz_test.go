package cudart

import (
	"encoding/binary"
	"testing"
)

// FuzzLayoutCopies decodes a layout and page lists from raw bytes (as a
// session's KV layout arrives from a client) and checks that Copies either
// rejects them or returns copies that stay inside the regions and the host
// pages, and that MergeRuns keeps every byte.
func FuzzLayoutCopies(f *testing.F) {
	f.Add([]byte{1, 0, 0, 0, 0, 16, 0, 0, 0, 16, 0, 0, 8, 0, 3, 1, 2, 5})
	f.Add([]byte{2, 0, 0, 0, 0, 32, 0, 0, 0, 16, 0, 0, 4, 0, 2, 0, 1})
	f.Add([]byte{3, 255, 255, 255, 255, 255, 255, 255, 255, 1, 0, 0, 0, 0, 1, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) < 1 {
			return
		}
		nreg := int(data[0]%4) + 1
		data = data[1:]
		var l Layout
		for i := 0; i < nreg && len(data) >= 14; i++ {
			l.Regions = append(l.Regions, Region{
				Base:      DevicePtr(uint64(i+1) << 40),
				Stride:    uint64(binary.LittleEndian.Uint32(data[0:])),
				PageBytes: uint64(binary.LittleEndian.Uint32(data[4:])) & 0xFFFFFF,
				Pages:     int(binary.LittleEndian.Uint16(data[8:])),
			})
			data = data[14:]
		}
		var dev []int
		var host []uintptr
		hpb := uintptr(l.HostPageBytes())
		for i, b := range data {
			dev = append(dev, int(int8(b)))
			host = append(host, uintptr(1<<50)+uintptr(i)*(hpb+1))
		}
		dir := HostToDevice
		if len(data)%2 == 1 {
			dir = DeviceToHost
		}
		copies, err := l.Copies(dir, dev, host)
		if err != nil {
			return
		}
		if len(copies) != len(dev)*len(l.Regions) {
			t.Fatalf("%d copies for %d pages of %d regions", len(copies), len(dev), len(l.Regions))
		}
		var total uint64
		for i, c := range copies {
			r := l.Regions[i/len(dev)]
			d, h := c.Src, c.Dst
			if dir == HostToDevice {
				d, h = c.Dst, c.Src
			}
			end := uint64(r.Base) + uint64(r.Pages-1)*r.Stride + r.PageBytes
			if uint64(d) < uint64(r.Base) || uint64(d)+c.Bytes > end || c.Bytes != r.PageBytes {
				t.Fatalf("copy %d: device %#x+%d outside region %+v", i, d, c.Bytes, r)
			}
			hp := host[i%len(dev)]
			if h < hp || h+uintptr(c.Bytes) > hp+hpb {
				t.Fatalf("copy %d: host %#x+%d outside its host page %#x+%d", i, h, c.Bytes, hp, hpb)
			}
			total += c.Bytes
		}
		var merged uint64
		for _, c := range MergeRuns(copies) {
			merged += c.Bytes
		}
		if merged != total {
			t.Fatalf("MergeRuns moved %d bytes, copies %d", merged, total)
		}
		// Appending to a used buffer gives the same copies after what it
		// held, and merging in place the same runs as MergeRuns.
		head := []Copy{{Dst: 1, Src: 2, Bytes: 3}}
		appended, err := l.AppendCopies(head, dir, dev, host)
		if err != nil || len(appended) != 1+len(copies) || appended[0] != head[0] || !equalCopies(appended[1:], copies) {
			t.Fatalf("AppendCopies: %d copies, %v; Copies gave %d", len(appended), err, len(copies))
		}
		if !equalCopies(MergeRunsInPlace(appended[1:]), MergeRuns(copies)) {
			t.Fatal("MergeRunsInPlace and MergeRuns differ")
		}
	})
}
