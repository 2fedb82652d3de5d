// `llama-kv-cache/node-llama-cpp`: prompt reuse for node-llama-cpp (3.22.1 and later).
// The types are structural: nothing here imports node-llama-cpp, and a `LlamaContextSequence`
// fits `NodeLlamaCppSequenceLike` as it is.

import type { PromptStore, PromptStoreOptions, StorePutResult } from '../index'

/**
 * What the adapter uses of a node-llama-cpp context sequence (`context.getSequence()`). Any
 * object with these members works; they are called as node-llama-cpp 3.22.1 defines them.
 */
export interface NodeLlamaCppSequenceLike {
  /** The tokens the sequence holds (node-llama-cpp's `Token[]`). */
  readonly contextTokens: readonly number[]
  /** The maximum number of tokens the sequence can hold. */
  readonly contextSize?: number
  /** Whether the sequence was disposed. */
  readonly disposed?: boolean
  /**
   * The model. The store is keyed by the model file's hash: node-llama-cpp's public `filename`
   * is only the file's base name, so the adapter reads the resolved path node-llama-cpp keeps
   * (`_modelPath`), or `filename` when that is an absolute path. `fileInsights` tells a
   * recurrent model (no KV streams) from the others.
   */
  readonly model: {
    readonly filename?: string
    readonly fileInsights?: { readonly isRecurrent?: boolean; readonly isHybrid?: boolean }
  }
  /**
   * The context: its flash attention (the V layout of files; with `'auto'` the layout is
   * learned from the first file saved or loaded) and its number of sequences (KV streams).
   */
  readonly context?: { readonly flashAttention?: boolean | 'auto'; readonly totalSequences?: number }
  /** A sequence with a token predictor (speculative decoding) is refused (`ERR_KV_UNSUPPORTED`). */
  readonly tokenPredictor?: unknown
  /** Disposal of the sequence closes its adapter. */
  readonly onDispose?: { createListener(callback: () => void): { dispose(): void } }
  /** Evaluates `tokens` after what the sequence holds and generates tokens. Wrapped. */
  evaluate(tokens: readonly number[], options?: any): AsyncGenerator<number, void, any>
  /** `evaluate` with metadata per generated token. Wrapped. */
  evaluateWithMetadata(tokens: readonly number[], metadata: any, options?: any): AsyncGenerator<any, void, any>
  /** Evaluates `tokens` after what the sequence holds, generating nothing. Wrapped. */
  evaluateWithoutGeneratingNewTokens(tokens: readonly number[], options?: any): Promise<void>
  /** Evaluates tokens with per-token output options (`[token, { generateNext }]`). Wrapped. */
  controlledEvaluate(input: readonly any[], options?: any): Promise<any[]>
  /** Writes the sequence's state and tokens to a sequence file (`ggsq` v3). */
  saveStateToFile(filePath: string): Promise<unknown>
  /** Loads a sequence file; `contextTokens` becomes the file's tokens. */
  loadStateFromFile(filePath: string, options: { acceptRisk: true }): Promise<void>
  /** Empties the sequence (used only if a restored state were not a prefix of the input). */
  clearHistory?(): Promise<void>
}

/** Options of `reusePrompts`: the adapter's own, and those of `new PromptStore` except `model`. */
export interface ReusePromptsOptions extends Omit<PromptStoreOptions, 'model'> {
  /**
   * Store the sequence's state after every evaluation (a checkpoint per turn), so the next
   * turn, in this process or another, restores it. Default true; false only restores.
   */
  putAfterEvaluation?: boolean
  /**
   * Also store the state at the end of a prompt (the sequence holding exactly the prompt),
   * saved when the app asks for the second generated token, so the first one is not delayed.
   * Chat sessions re-render a reply from its text, whose tokens can differ from those the
   * model generated; models that restore only at stored positions (sliding window, hybrid,
   * recurrent) then restore at the previous prompt's end. Default true.
   */
  putAfterPrompt?: boolean
  /**
   * Restore only when it spares evaluating at least this many tokens (default 16); when the
   * sequence already holds tokens, also at least 1/16 of the prefix, since a restore writes
   * and loads the whole prefix.
   */
  minRestoreTokens?: number
  /**
   * Called with every error the adapter absorbs (a failed lookup, write, load, save or put:
   * the evaluation goes on without the store), as `lastError` records them.
   */
  onError?: (error: Error & { code: string }) => void
}

/** What the latest evaluation's restore did, in tokens. */
export interface NodeLlamaCppRestoreReport {
  /** Tokens loaded from the store into the sequence (0: no restore). */
  restoredTokens: number
  /**
   * Tokens of the input node-llama-cpp evaluated after the restore (the prompt part; tokens it
   * generates afterwards are not counted).
   */
  evaluatedTokens: number
  /**
   * The longest prefix the store holds of the tokens the sequence was to hold (0 when not
   * looked up: too few tokens to spare).
   */
  lookupTokens: number
  /** Tokens the sequence held before the evaluation (its common prefix with the input). */
  heldTokens: number
}

/** What `reusePrompts` returns. */
export interface NodeLlamaCppPromptReuse {
  /** The PromptStore this adapter restores from and puts into. */
  readonly store: PromptStore
  /** The latest evaluation's restore, or null before the first one. */
  readonly lastRestore: NodeLlamaCppRestoreReport | null
  /** What the latest successful put stored (`PromptStore.putFile`'s result), or null. */
  readonly lastPut: StorePutResult | null
  /**
   * The latest error the adapter absorbed, or null. A failed restore or put never fails the
   * app's evaluation: the sequence evaluates without the store, and the error lands here (and
   * in `onError`), always with an `ERR_KV_*` code (`ERR_KV_STORE_IO`, `ERR_KV_STORE_GEOMETRY`,
   * `ERR_KV_INVALID_STATE` for a file the peer refused, ...). Errors of the evaluation itself
   * reach the app as node-llama-cpp throws them.
   */
  readonly lastError: (Error & { code: string }) | null
  /** Whether `close()` was called (or the sequence disposed). */
  readonly closed: boolean
  /**
   * Detaches: the sequence's methods are its own again (it evaluates as before, without the
   * store), the puts in flight finish, and the adapter's private folder is removed. Idempotent.
   */
  close(): Promise<void>
}

/**
 * Keeps the prompts of a node-llama-cpp context sequence in a `PromptStore`, across restarts
 * and processes. The sequence's own evaluation methods (`evaluate`, `evaluateWithMetadata`,
 * `evaluateWithoutGeneratingNewTokens`, `controlledEvaluate`: what `LlamaChatSession`,
 * `LlamaChat` and `LlamaCompletion` call) are wrapped on this object only. Before an evaluation
 * the longest stored prefix of the tokens the sequence will hold is loaded into it, when longer
 * than what it holds, and node-llama-cpp evaluates the rest; after it, the sequence's state is
 * stored. The store's model is the sequence's model file (a `model` option is refused).
 *
 * Throws `ERR_KV_INVALID_ARG` for a value that is not a sequence or a bad or unknown option,
 * `ERR_KV_DISPOSED` for a disposed sequence, `ERR_KV_UNSUPPORTED` for a sequence with a token
 * predictor or a context with LoRA adapters.
 *
 * @example
 * const { reusePrompts } = require('llama-kv-cache/node-llama-cpp')
 * const reuse = reusePrompts(sequence, { path: '/var/cache/prompts' })
 * const session = new LlamaChatSession({ contextSequence: sequence })
 * await session.prompt('Hello')      // restores the longest stored prefix, then stores the turn
 * console.log(reuse.lastRestore)     // { restoredTokens, evaluatedTokens, lookupTokens, heldTokens }
 * await reuse.close()
 */
export declare function reusePrompts(sequence: NodeLlamaCppSequenceLike, options?: ReusePromptsOptions): NodeLlamaCppPromptReuse
