// `llama-kv-cache/llama.node`: prompt reuse for @fugood/llama.node (1.7.15 and later).
// The types are structural: nothing here imports @fugood/llama.node.

import type { PromptStore, PromptStoreOptions, StorePutResult } from '../index'

/**
 * What the adapter uses of a llama.node context: the object `loadModel()` resolves to.
 * Any object with these methods works (they are called as llama.node 1.7.15 defines them).
 */
export interface LlamaNodeContextLike {
  /** Runs a completion; resolves to a result with `timings.prompt_n` (prompt tokens evaluated). */
  completion(options: any, callback?: (token: any) => void): Promise<any>
  /** Tokenizes text as `completion` does, without the vocabulary's BOS. */
  tokenize(text: string): Promise<{ tokens: Int32Array | ArrayLike<number> }>
  /** Writes the context's state and token list to a session file (`ggsn` v9). */
  saveSession(path: string): Promise<void>
  /** Loads a session file; the next completion reuses its tokens' common prefix with the prompt. */
  loadSession(path: string): Promise<void>
  /** Clears the KV and recurrent caches and the token list. */
  clearCache(clearData?: boolean): void
  /** What the context loaded: `metadata` (GGUF key/values as strings), `nEmbd`, `size`, `is_recurrent`, `is_hybrid`. */
  getModelInfo(): {
    desc?: string
    nEmbd?: number
    nParams?: number
    size?: number
    is_recurrent?: boolean
    is_hybrid?: boolean
    metadata?: Record<string, string>
  }
  /** Interrupts a running completion (used for an aborted `signal`). */
  stopCompletion?(): void
  /** Formats chat `messages` as the completion will (used to look up a `messages` completion). */
  getFormattedChat?(messages: any[], template?: string, params?: any): string | { prompt: string }
  /** The LoRA adapters applied (part of the store's model: they change K/V). */
  getLoadedLoraAdapters?(): Array<{ path: string; scaled: number }>
}

/** Options of `reusePrompts`: the adapter's own, and those of `new PromptStore` except `model`. */
export interface ReusePromptsOptions extends Omit<PromptStoreOptions, 'model'> {
  /**
   * The GGUF file the context loaded (the `model` given to `loadModel`). Required: llama.node's
   * context does not say which file it loaded. The store is keyed by this file's hash, and the
   * file is checked against what the context reports (architecture, name, widths, layers,
   * trained context, memory kind, tensor bytes and, through llama.node's own GGUF reader, every
   * metadata value): another model is refused with `ERR_KV_STORE_GEOMETRY` naming the field.
   * A `model` option is refused (`ERR_KV_INVALID_ARG`).
   */
  modelPath: string
  /**
   * Save the context after every completion and store it (a checkpoint per turn), so the next
   * turn, in this process or another, restores it. Default true; false only restores.
   */
  checkpoints?: boolean
  /**
   * Whether the context runs with flash attention (its V rows untransposed), for the files
   * written to it. Default: learned from the context's first checkpoint; before that a file of
   * the store's first layout is tried, then one of the other layout.
   */
  flashAttn?: boolean
}

/** What the latest completion's restore did, in tokens. */
export interface LlamaNodeRestoreReport {
  /** Tokens loaded from the store into the context (0: no restore). */
  restoredTokens: number
  /** Prompt tokens the peer evaluated (its own `timings.prompt_n`). */
  evaluatedTokens: number
  /**
   * The longest prefix of the prompt the store holds (0 when not looked up: the context held
   * as much already, or the prompt's tokens could not be known).
   */
  lookupTokens: number
  /** The prompt's tokens as the peer evaluates them (0 when they could not be known: media). */
  promptTokens: number
  /** Tokens the context already held and could keep without a restore. */
  reusedTokens: number
  /**
   * Why the turn did not restore (the lookup or the restore failed, the prompt's tokens could
   * not be known, the LoRA adapters changed): the completion then ran as llama.node alone
   * would. Null otherwise.
   */
  error: Error | null
}

/** Completion options of llama.node, plus an `AbortSignal`. */
export interface ReuseCompletionOptions {
  /** The prompt text (as for llama.node's `completion`). */
  prompt?: string
  /** Chat messages (as for llama.node's `completion`: formatted with the model's template). */
  messages?: any[]
  /**
   * Aborts the turn: a queued turn never starts, a restore stops, a running completion is
   * stopped (`stopCompletion`) and the context's state is still checkpointed; the promise
   * rejects with `ERR_KV_ABORTED` (`name` `AbortError`). Not passed to llama.node.
   */
  signal?: AbortSignal
  /** Every other option of llama.node's `completion`, passed on unchanged. */
  [option: string]: any
}

/**
 * Prompt reuse for one llama.node context, from `reusePrompts`. Completions run one at a time
 * (a queue): concurrent calls never share the context or a file. Its files live in one private
 * folder (mode 0700) in the OS temp dir, each removed once loaded or stored, whatever happens,
 * and the folder on `close()` (and at process exit). Run every completion of the context
 * through the adapter: one run on the context directly leaves the adapter's idea of what the
 * context holds stale, which costs a restore (or misses one), never a wrong result, since
 * llama.node itself keeps only the common prefix of what it holds and the prompt.
 */
export interface LlamaNodePromptReuse {
  /**
   * `context.completion(options, callback)`, with the store's longest prefix of the prompt
   * loaded first where it is longer than what the context holds, and a checkpoint of the
   * context stored after it (before the promise resolves). Resolves to llama.node's own result.
   * The store's work never fails the turn: a failed lookup, restore or put falls back to what
   * llama.node alone does and is reported in `lastError` (and `lastRestore.error`).
   * Rejects with `ERR_KV_INVALID_ARG` (options not an object, `prompt` not a string, callback
   * not a function, `signal` not an AbortSignal), `ERR_KV_DISPOSED` after `close()`,
   * `ERR_KV_ABORTED`, `ERR_KV_BUSY` (the context is busy with a completion not run by this
   * adapter, or llama.node 1.7.15 left it marked busy: use a new context and adapter), or
   * `ERR_KV_BACKEND` (llama.node's completion failed; its error is the `cause`).
   */
  completion(options: ReuseCompletionOptions, callback?: (token: any) => void): Promise<any>
  /** What the latest completion's restore did; null before the first. */
  readonly lastRestore: LlamaNodeRestoreReport | null
  /** What the latest completion's checkpoint stored; null when it stored nothing. */
  readonly lastCheckpoint: StorePutResult | null
  /**
   * The latest completion's failure in the store's work (lookup, restore, checkpoint), with its
   * `ERR_KV_*` code; null when there was none.
   */
  readonly lastError: Error | null
  /** The store (keyed by `modelPath`'s file, plus any LoRA adapters the context had). */
  readonly store: PromptStore
  /** The context. */
  readonly context: LlamaNodeContextLike
  /** The model file the store is keyed by. */
  readonly modelPath: string
  /** The tokens the context holds after this adapter's latest completion (a copy). */
  readonly contextTokens: number[]
  /** Whether `close()` was called. */
  readonly closed: boolean
  /** Waits for queued completions, then removes the private folder. Later completions reject with `ERR_KV_DISPOSED`. */
  close(): Promise<void>
}

/**
 * Prompt reuse for a @fugood/llama.node context:
 * `reusePrompts(context, { modelPath: '/models/x.gguf', path: '/var/cache/prompts' })`.
 * Throws `ERR_KV_INVALID_ARG` (not a llama.node context, a missing `modelPath`, a `model`
 * option, an unknown option, a value of the wrong type), `ERR_KV_STORE_GEOMETRY` (`modelPath`
 * is not the model the context loaded; `field` names what differs), `ERR_KV_IO` /
 * `ERR_KV_INVALID_MODEL` (`modelPath` cannot be read or is not a GGUF file).
 */
export declare function reusePrompts(context: LlamaNodeContextLike, options: ReusePromptsOptions): LlamaNodePromptReuse
