// (d) jest, first file: jest loads the addon once per test file (each file gets a fresh module registry).
const { KvCache } = require('llama-kv-cache')

describe('KvCache under jest', () => {
  test('places, removes and views sequences', () => {
    const cache = new KvCache({ size: 16, nLayer: 1, nEmbdKGqa: 8, nSeqMax: 2 })
    expect(cache.findSlot({ pos: [0, 1, 2, 3], seqIds: [0, 0, 1, 1] })).toEqual({ head: 0, len: 4, n: 16 })
    expect(cache.seqRm(1)).toBe(true)
    expect(cache.view().usedCells).toBe(2)
    expect(() => cache.seqDiv(0, 0, -1, 0)).toThrow(expect.objectContaining({ code: expect.stringMatching(/^ERR_KV_/) }))
  })
})
